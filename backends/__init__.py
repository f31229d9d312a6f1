"""dsv4.backends: one backend per folder, each registered through the dsv4.backends entry points."""
