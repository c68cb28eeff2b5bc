"""Worker of the multi-host stop tests: write "<pid> <agent pid>" to $SW_TEST_DIR/rank_<RANK>, then
either fail (on node $SW_TEST_FAIL_NODE, once every rank of node 0 has started) or sleep, so that
a test can check that stopping the job leaves none of these processes behind."""

import os
import sys
import time

out = os.environ["SW_TEST_DIR"]
rank, node = os.environ["RANK"], os.environ["GROUP_RANK"]
with open(os.path.join(out, f"rank_{rank}.tmp"), "w") as fh:
    fh.write(f"{os.getpid()} {os.getppid()}\n")
os.replace(os.path.join(out, f"rank_{rank}.tmp"), os.path.join(out, f"rank_{rank}"))
print(f"STARTED rank={rank} node={node}", flush=True)
if node == os.environ.get("SW_TEST_FAIL_NODE"):
    deadline = time.monotonic() + 60
    while not all(os.path.exists(os.path.join(out, f"rank_{r}")) for r in range(int(os.environ["LOCAL_WORLD_SIZE"]))):
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    print(f"FAILING rank={rank}", flush=True)
    sys.exit(3)
time.sleep(600)
