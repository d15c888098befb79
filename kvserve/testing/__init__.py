"""What the tests, the benchmarks and the examples share: servers run as processes, their /metrics
read, a fleet of replicas behind a router, tiny random-weight models.

It lives in the package, not in tests/ or bench/, so that each of them imports it from any
install, with no folder put on sys.path. This module and `processes`, `metrics` and `fleet` need
only kvserve's own dependencies; `tiny_models` also needs `gguf` (the test and bench extras), and
the routers `fleet` starts come with the test extra.

    with ServerProcess.kvserve(log, model=path, parallel=4) as server:
        server.wait_healthy()
        read_metrics(server.url).value("kvserve_requests_running")
"""

from __future__ import annotations

from kvserve.testing.metrics import Metrics, read_metrics
from kvserve.testing.processes import ServerExited, ServerProcess, free_port, http_get, kvserve_command, wait_until
