"""engine/allocator.py: what an engine's thread frees stays mapped for its next object."""

from __future__ import annotations

import json
import subprocess
import sys

# In a fresh interpreter (glibc's thresholds as a new process has them): a thread that is not the
# main one allocates 30 MB in 1.5 MB blocks, writes them and frees them, four times, as an
# object's geometry does on the scheduler's thread; the page faults of each time.
ROUNDS = """
import json, resource, sys, threading
import numpy as np
if sys.argv[1] == "keep":
    from cubeserve.engine.allocator import keep_freed_memory
    assert keep_freed_memory()
faults = []
def work():
    for _ in range(4):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [np.ones(3 << 17, np.float32) for _ in range(20)]
        del blocks
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
thread = threading.Thread(target=work)
thread.start()
thread.join()
print(json.dumps(faults))
"""


def faults(mode: str) -> list[int]:
    done = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def test_the_memory_a_thread_frees_is_not_faulted_in_again():
    kept = faults("keep")
    # 7,700 faults the first time (30 MB of new pages), then next to none. With glibc's own
    # thresholds the second time faults them all in again (7,680 of 7,700 here; the engine's
    # stub did so for every object: issue 53).
    assert kept[0] > 5000, kept
    assert max(kept[1:]) < kept[0] / 10, kept
