"""Runtime route changes and where they live: in this process (``route_store``), or in
etcd, shared by every replica of a fleet (``etcd_store`` over the ``etcd`` client, with the
replicas' leases and records in ``membership`` and the rollout decider in
``rollout_decider``)."""
