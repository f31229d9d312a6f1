"""The backend model: capabilities as data, op requests, and the ``Backend`` base class.

A backend declares what it can do in a frozen :class:`Capabilities` record; the registry
(:mod:`dsv4.registry`) asks two questions of it before dispatching an op:

- :meth:`Backend.probe` -> reasons the backend cannot run *here at all* (a vendor package not
  importable, the wrong arch). Empty list: available. Probes import vendor packages lazily.
- :meth:`Backend.not_supported_reasons` -> reasons it cannot run *this* :class:`OpRequest`
  (format, head count, top-k alignment, profile ...). Empty list: supported.

Each reason is one plain sentence naming what is needed and what was found, so that a
``NoBackendError`` that lists every candidate explains itself (see ``docs/ARCHITECTURE.md`` §4).

Op methods have exactly the signatures of ``docs/ARCHITECTURE.md`` §3 (the reference ops in
``dsv4.reference``). A backend that does not implement an op leaves it out of
``capabilities.ops`` (whose default is all six: a plugin backend that lists an op it does not
override is refused at registration, :meth:`Backend.unimplemented_ops`); the base methods raise
``BackendUnavailableError``.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from importlib import metadata
from typing import Any, ClassVar

import torch
from dsv4.metadata import check_compressed_pages, topk_local_to_global
from dsv4.specs.errors import BackendUnavailableError

__all__ = [
    "OP_NAMES",
    "REASON_CHARS",
    "Backend",
    "Capabilities",
    "ExpectedFailure",
    "OpRequest",
    "OptionalImport",
    "device_arch",
    "missing_parameters",
    "one_line",
    "platform_of",
]

# The six ops of ARCHITECTURE.md §3, in pipeline order.
OP_NAMES: tuple[str, ...] = (
    "qnorm_rope_insert",
    "compress_insert",
    "indexer_q",
    "indexer_topk",
    "sparse_attention",
    "output_projection",
)


def _names(values: Any) -> str:
    return ", ".join(str(v) for v in sorted(values, key=str))


@dataclass(frozen=True)
class Capabilities:
    """What a backend can run, as data. ``None`` in a set-valued field means "any".

    Fields:
        ops: op names it implements (subset of :data:`OP_NAMES`). The default is all six: a backend that
            implements fewer must list them (a plugin's backend listing one it does not override is refused).
        device_types: torch device types (``"cpu"``, ``"cuda"``, ``"xpu"``, ``"npu"``); ROCm is ``"cuda"``.
        archs: exact arch names (``"sm_90"``, ``"sm_100"``, ``"gfx950"``, ``"ascend910b"``), or None.
        arch_range: inclusive CUDA SM range as integers, e.g. ``(100, 103)``; None: no range check.
        dtypes: activation dtypes accepted (``q`` / ``o`` / ``index_q``), e.g. ``{torch.bfloat16}``.
        kv_formats: 512-d latent cache formats it reads/writes (SPEC §9.1-9.2), None: any.
        indexer_key_formats: indexer key cache formats (SPEC §9.3), None: any.
        q_head_counts: head counts with a kernel, None: any.
        q_head_padding: head counts it pads up to (e.g. ``(64, 128)`` for FlashMLA); informative,
            a request with more heads than the largest entry is refused.
        topk_alignment: the top-k width must be a multiple of this (SPEC §11).
        supports_sink: honours the per-head attention sink (SPEC §7).
        returns_lse: returns a real LSE from ``sparse_attention``.
        profiles: numerics profiles it implements (SPEC §6.6), None: any.
        cuda_graphs: safe to capture under CUDA graphs (metadata built before capture).
    """

    ops: frozenset[str] = frozenset(OP_NAMES)
    device_types: frozenset[str] | None = None
    archs: frozenset[str] | None = None
    arch_range: tuple[int, int] | None = None
    dtypes: frozenset[torch.dtype] | None = frozenset({torch.bfloat16})
    kv_formats: frozenset[str] | None = None
    indexer_key_formats: frozenset[str] | None = None
    q_head_counts: frozenset[int] | None = None
    q_head_padding: tuple[int, ...] = ()
    topk_alignment: int = 1
    supports_sink: bool = True
    returns_lse: bool = True
    profiles: frozenset[str] | None = None
    cuda_graphs: bool = False

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready view (sets sorted, dtypes by name) for reports and ``dsv4-conformance list``."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, frozenset):
                value = sorted(str(v).replace("torch.", "") for v in value)
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    def reasons(self, request: OpRequest) -> list[str]:
        """Every reason this capability set refuses ``request`` (empty: supported)."""
        reasons: list[str] = []
        if request.op not in self.ops:
            reasons.append(f"does not implement op {request.op} (implements: {_names(self.ops) or 'none'})")
        if self.device_types is not None and request.device_type not in self.device_types:
            reasons.append(f"needs device type {_names(self.device_types)}, found {request.device_type}")
        if self.archs is not None and request.arch is not None and request.arch not in self.archs:
            reasons.append(f"needs arch {_names(self.archs)}, found {request.arch}")
        if self.arch_range is not None and request.arch is not None:
            sm = _sm_number(request.arch)
            low, high = self.arch_range
            if sm is None or not low <= sm <= high:
                reasons.append(f"needs sm_{low}..sm_{high}, found {request.arch}")
        if self.dtypes is not None and request.dtype is not None and request.dtype not in self.dtypes:
            reasons.append(f"needs dtype {_names(self.dtypes)}, found {request.dtype}")
        if self.kv_formats is not None and request.kv_format is not None \
                and request.kv_format not in self.kv_formats:
            reasons.append(f"needs kv_format {_names(self.kv_formats)}, found {request.kv_format}")
        if self.indexer_key_formats is not None and request.indexer_key_format is not None \
                and request.indexer_key_format not in self.indexer_key_formats:
            reasons.append(f"needs indexer key format {_names(self.indexer_key_formats)}, "
                           f"found {request.indexer_key_format}")
        if request.heads is not None:
            if self.q_head_counts is not None and request.heads not in self.q_head_counts:
                reasons.append(f"needs q heads in {_names(self.q_head_counts)}, found {request.heads}")
            if self.q_head_padding and request.heads > max(self.q_head_padding):
                reasons.append(f"pads q heads up to {max(self.q_head_padding)}, found {request.heads}")
        if request.topk is not None and request.topk % self.topk_alignment != 0:
            reasons.append(f"needs top-k width a multiple of {self.topk_alignment}, found {request.topk}")
        if request.has_sink and not self.supports_sink:
            reasons.append("does not support the attention sink (SPEC §7)")
        if request.needs_lse and not self.returns_lse:
            reasons.append("does not return the LSE")
        if self.profiles is not None and request.profile is not None and request.profile not in self.profiles:
            reasons.append(f"needs numerics profile {_names(self.profiles)}, found {request.profile}")
        if request.cuda_graph and not self.cuda_graphs:
            reasons.append("not capturable under CUDA graphs")
        return reasons


def _sm_number(arch: str) -> int | None:
    # "sm_90a" -> 90, "sm_100f" -> 100; anything else (gfx, ascend) has no SM number.
    if not arch.startswith("sm_"):
        return None
    digits = "".join(ch for ch in arch[3:] if ch.isdigit())
    return int(digits) if digits else None


@dataclass(frozen=True)
class OpRequest:
    """One op call as the registry sees it. Hashable, so selections can be cached.

    ``None`` in a field means "does not apply / not known"; capability checks skip it.
    """

    op: str
    device_type: str = "cpu"
    arch: str | None = None
    dtype: torch.dtype | None = None
    kv_format: str | None = None
    indexer_key_format: str | None = None
    heads: int | None = None
    topk: int | None = None
    profile: str | None = None
    has_sink: bool = False
    needs_lse: bool = False
    cuda_graph: bool = False
    extra: tuple[tuple[str, Any], ...] = field(default=())

    @property
    def platform(self) -> str:
        """``cpu``, ``cuda``, ``rocm``, ``xpu`` or ``npu`` (the key of the registry's priority lists)."""
        return platform_of(self.device_type)

    def describe(self) -> str:
        """Short text for error messages: only the fields that are set."""
        parts = [f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                 if getattr(self, f.name) not in (None, False, ())]
        return "OpRequest(" + ", ".join(parts) + ")"


def platform_of(device_type: str) -> str:
    """Platform key for a torch device type: ROCm reports device type ``cuda`` but a HIP torch."""
    if device_type == "cuda" and getattr(torch.version, "hip", None):
        return "rocm"
    return device_type


def device_arch(device: torch.device | str) -> str | None:
    """Arch name of a device: ``sm_90`` / ``sm_100`` (CUDA), ``gfx950`` (ROCm), else None.

    Queries the driver, so call it once per device (the registry caches it), not per op.
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device)
    gcn = getattr(props, "gcnArchName", "")
    if getattr(torch.version, "hip", None) and gcn:
        return gcn.split(":")[0]
    return f"sm_{props.major}{props.minor}"


REASON_CHARS = 300  # a reason is one line of at most this many characters


def one_line(text: str, limit: int | None = REASON_CHARS) -> str:
    """A reason as one line: whitespace runs (newlines included) collapsed, cut to ``limit`` characters
    (None: whole, as the CLI prints an error)."""
    text = " ".join(text.split())
    return text if limit is None or len(text) <= limit else text[:limit - 3] + "..."


def missing_parameters(fn: Callable[..., Any], names: tuple[str, ...]) -> list[str]:
    """The ``names`` that ``fn``'s signature does not accept (all of them when it has no signature): a
    vendor entry point too old for the arguments a backend passes, found at import instead of mid-call."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return list(names)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    return [name for name in names if name not in params]


class OptionalImport:
    """A vendor module imported on first use, once, with the reason it is absent (xformers-style).

    ``loader()`` returns the module (or entry point); it may raise ``BackendUnavailableError`` for a
    present-but-unusable package. ``result()`` -> ``(module | None, reason | None)`` (cached);
    ``get()`` -> the module, or ``BackendUnavailableError`` with the one-line reason.
    """

    # Any exception from a vendor import means "absent": besides ImportError, dlopen (OSError) and CUDA/ROCm
    # initialisation (RuntimeError) failures, broken packages raise AttributeError, TypeError, ValueError...

    def __init__(self, label: str, loader: Callable[[], Any]):
        self.label, self.loader = label, loader
        self._result: tuple[Any, str | None] | None = None

    def result(self) -> tuple[Any, str | None]:
        if self._result is None:
            try:
                self._result = (self.loader(), None)
            except BackendUnavailableError as exc:
                self._result = (None, one_line(str(exc)))
            except Exception as exc:  # noqa: BLE001 - any load failure is a reason, recorded once
                self._result = (None, one_line(f"{self.label} not importable: {type(exc).__name__}: {exc}"))
        return self._result

    def get(self) -> Any:
        module, reason = self.result()
        if module is None:
            raise BackendUnavailableError(reason or f"{self.label} not importable")
        return module

    def reasons(self, injected: Any = None) -> list[str]:
        """A probe's import reasons: none when ``injected`` (a module a test or caller passed in)
        stands in for the import, else ``[reason]`` when the import fails."""
        if injected is not None:
            return []
        _, reason = self.result()
        return [reason] if reason else []


@dataclass(frozen=True)
class ExpectedFailure:
    """A conformance case a backend is known to fail, with how far (a value of ``Backend.expected_failures``).

    ``bounds``: ``"<output>.<metric>"`` -> the most that metric may reach (``{"out.cos_diff": 1e-3}``), far
    run included. With bounds, the row is an expected failure only while every failing output is bounded and
    within its bounds; without, any numeric failure is. An exception, a modified input or a far run that
    raised is never an expected failure.
    """

    reason: str
    bounds: Mapping[str, float] = field(default_factory=dict)


class Backend:
    """Base class of every backend. Subclasses set ``name`` and ``capabilities``.

    Optional class attributes:
        packages: distribution names whose versions reports show (looked up without importing).
        expected_failures: conformance case-id glob -> reason, or an :class:`ExpectedFailure` with metric
            bounds; the suite marks matching failed cases as expected failures and warns about entries
            that match no case (SPEC §13 stays the bar).
    """

    name: ClassVar[str] = ""
    capabilities: ClassVar[Capabilities] = Capabilities(ops=frozenset())
    packages: ClassVar[tuple[str, ...]] = ()
    expected_failures: ClassVar[Mapping[str, str | ExpectedFailure]] = {}

    # -- availability ---------------------------------------------------------------------------
    def probe(self) -> list[str]:
        """Reasons this backend cannot run on this machine (empty: available). Imports lazily."""
        return []

    def not_supported_reasons(self, request: OpRequest) -> list[str]:
        """Reasons this backend refuses ``request`` (empty: supported). Extend with ``super()``."""
        return self.capabilities.reasons(request)

    def package_versions(self) -> dict[str, str | None]:
        """Installed versions of :attr:`packages` (None where not installed); never imports them."""
        versions: dict[str, str | None] = {}
        for dist in self.packages:
            try:
                versions[dist] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                versions[dist] = None
        return versions

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"

    def unimplemented_ops(self) -> list[str]:
        """Names in ``capabilities.ops`` this backend has no op method for: not an op of :data:`OP_NAMES`, or an
        op whose method is still the base class's (which raises). Empty for a consistent backend."""
        own = getattr(self, "__dict__", {})
        return [op for op in sorted(self.capabilities.ops)
                if op not in OP_NAMES or (getattr(type(self), op, None) is getattr(Backend, op) and op not in own)]

    def _missing(self, op: str) -> BackendUnavailableError:
        cls = type(self).__name__
        if op in self.capabilities.ops:  # declared (perhaps by the default, all six) but never overridden
            return BackendUnavailableError(
                f"op: backend {self.name} declares {op} in capabilities.ops but {cls} does not override "
                f"Backend.{op}: implement it, or pass Capabilities(ops=...) with only the ops it implements "
                "(the default is all six)", argument="op", expected=f"an override of Backend.{op}", received=cls)
        return BackendUnavailableError.of("op", f"one of {_names(self.capabilities.ops) or 'none'}",
                                          op, hint=f"backend {self.name} does not implement it")

    # -- ops (ARCHITECTURE.md §3 signatures) -----------------------------------------------------
    def qnorm_rope_insert(self, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                          cos_sin: torch.Tensor, swa_cache: torch.Tensor, swa_slot_mapping: torch.Tensor,
                          *, kv_format: str, eps: float, profile: str = "deepseek") -> torch.Tensor:
        """q [T,H,512] bf16 -> q_out [T,H,512]; writes roped kv [T,512] into ``swa_cache`` (SPEC §3).

        ``profile`` fixes the q-norm rounding points (SPEC §6.6)."""
        raise self._missing("qnorm_rope_insert")

    def compress_insert(self, kv_score: torch.Tensor, positions: torch.Tensor, token_request: torch.Tensor,
                        state_cache: torch.Tensor, state_block_table: torch.Tensor,
                        state_slot_mapping: torch.Tensor, ape: torch.Tensor, norm_weight: torch.Tensor,
                        cos_sin: torch.Tensor, out_cache: torch.Tensor, out_slot_mapping: torch.Tensor,
                        *, ratio: int, head_dim: int, out_format: str, profile: str, eps: float,
                        windows_in_call: bool = False) -> None:
        """kv_score [T, 2*coff*d] fp32: save state, compress closed blocks into ``out_cache`` (SPEC §5).
        ``windows_in_call``: a host-side promise that no closing block reads state of an earlier call
        (``dsv4.ops.compress_insert``); a backend may ignore it, never change its result."""
        raise self._missing("compress_insert")

    def indexer_q(self, index_q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor,
                  cos_sin: torch.Tensor, *, profile: str) -> tuple[torch.Tensor, torch.Tensor]:
        """index_q [T,64,128] bf16, weights [T,64] -> (q [T,64,128] bf16, w [T,64] fp32) (SPEC §6.1-6.2)."""
        raise self._missing("indexer_q")

    def indexer_topk(self, q: torch.Tensor, w: torch.Tensor, positions: torch.Tensor,
                     token_request: torch.Tensor, key_cache: torch.Tensor, key_block_table: torch.Tensor,
                     *, topk: int, key_format: str, ratio: int = 4) -> torch.Tensor:
        """-> [T, topk] int32 request-local compressed indices, valid first, -1 padded (SPEC §6.3)."""
        raise self._missing("indexer_topk")

    def indexer_topk_slots(self, q: torch.Tensor, w: torch.Tensor, positions: torch.Tensor,
                           token_request: torch.Tensor, key_cache: torch.Tensor, key_block_table: torch.Tensor,
                           compressed_block_table: torch.Tensor, *, topk: int, key_format: str,
                           compressed_block_size: int, ratio: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
        """``indexer_topk``, then its indices as global slots of the compressed cache (SPEC §10):
        (slots [T, topk] int32, -1 where none; lens [T] int32, the slots >= 0 a row).

        compressed_block_table [R, mb] int32 and ``compressed_block_size``: the compressed group's pages.
        What the layer calls on its direct path (``dsv4.layer_dispatch``). Here the op then
        :func:`dsv4.metadata.topk_local_to_global` (~20 small torch ops); a backend may fuse the
        conversion (Triton: one launch). Results must equal this composition bit for bit."""
        block_size = check_compressed_pages(compressed_block_table, compressed_block_size)
        local = self.indexer_topk(q, w, positions, token_request, key_cache, key_block_table, topk=topk,
                                  key_format=key_format, ratio=ratio)
        return topk_local_to_global(local, token_request, compressed_block_table, block_size)

    def sparse_attention(self, q: torch.Tensor, swa_cache: torch.Tensor, swa_indices: torch.Tensor,
                         swa_lens: torch.Tensor, extra_cache: torch.Tensor | None,
                         extra_indices: torch.Tensor | None, extra_lens: torch.Tensor | None,
                         sink: torch.Tensor, *, kv_format: str, softmax_scale: float,
                         profile: str) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T,H,512] -> (out [T,H,512] q.dtype, lse [T,H] fp32) over global slots (SPEC §7)."""
        raise self._missing("sparse_attention")

    def output_projection(self, o: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                          wo_a: torch.Tensor, wo_b: torch.Tensor, *, fp8_activations: bool) -> torch.Tensor:
        """o [T,H,512] -> [T, hidden]: inverse RoPE then grouped projection (SPEC §3 steps 6-7, §8)."""
        raise self._missing("output_projection")
