"""Runs a command in a network and mount namespace of its own: `make node-test` runs pytest through
it, so that the real node's pods, bridge, routes and kube-proxy's rules exist only there.

    python3 tests/netns.py -- COMMAND ...

Inside, only the loopback and what the test makes exist: every address the node test dials (the
control plane's 127.0.0.1, the pods' bridge, the Services' virtual IPs) belongs to the namespace,
and everything in it (bridge, veths, iptables rules, mounts of containerd and the kubelet) ends
with its last process. `unshare` (util-linux), not `ip netns exec`, which remounts /sys. Needs root.
"""

from __future__ import annotations

import os
import sys

# Set inside to the network namespace (its inode) that the run was started from, so that the
# tests can tell they run in another (PID 1's may not be readable, even by root).
INSIDE_ENV = "CUBESERVE_NODE_NETNS"


def _namespace() -> int:
    return os.stat("/proc/self/ns/net").st_ino


def own_network_namespace() -> bool:
    """Whether this process runs in a network namespace that tests/netns.py made."""
    outside = os.environ.get(INSIDE_ENV, "")
    return outside.isdigit() and int(outside) != _namespace()


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise SystemExit(__doc__)
    if own_network_namespace():
        os.execvp(argv[0], argv)
    if os.geteuid() != 0:
        raise SystemExit("tests/netns.py: the node tests need root (network and mount namespaces, cgroups, containers)")
    # --propagation private: the mounts made inside (container root filesystems, pod volumes,
    # network namespace files) never appear outside.
    script = "ip link set lo up && exec \"$@\""
    os.execvpe("unshare", ["unshare", "--net", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh",
                           *argv], {**os.environ, INSIDE_ENV: str(_namespace())})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
