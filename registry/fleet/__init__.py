"""Runtime route changes and where they live: in this process (``route_store``), or in
etcd, shared by every replica of a fleet (``etcd_store`` over the ``etcd`` client)."""
