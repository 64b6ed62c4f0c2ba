"""The HTTP front ends: KServe v2 with Triton's extensions (``v2``, ``codec``, ``shm_http``,
``generate``), ``/predict``, the control plane under ``/admin/`` and the OpenAPI document."""
