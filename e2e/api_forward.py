"""A TCP forward for the real node's pods to the API server: what kube-proxy would do for one Service.

    python e2e/api_forward.py 10.0.0.1:443=127.0.0.1:6443

The kubelet gives every pod KUBERNETES_SERVICE_HOST/PORT = the ClusterIP of Service ``kubernetes``
(10.0.0.1:443). There is no kube-proxy on the local cluster, so ``cluster.sh`` puts that address on the
real node's pod bridge (pods route 10.0.0.1/32 to the bridge, nothing else) and this process forwards it
to the API server on loopback. The pods' in-cluster configuration then works unchanged (the API server's
certificate names 10.0.0.1). Runs until SIGTERM/SIGINT. Uses the test kubelet's forwarder.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading

from kubelet import ApiForwarder, _forward_spec


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 64
    logging.basicConfig(level=logging.INFO, format="%(asctime)s api-forward %(levelname)s %(message)s")
    fwd = ApiForwarder(*_forward_spec(argv[0]))
    fwd.start()
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    fwd.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
