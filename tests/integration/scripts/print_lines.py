"""Worker of the line-atomicity test: no torch, many lines, each printed in many pieces (print
writes each argument and separator on its own; unbuffered, each is a write of its own)."""

import os
import sys

rank = int(os.environ["RANK"])
for i in range(int(sys.argv[1])):
    print("LINE", f"rank={rank}", f"i={i}", *(f"w{j}" for j in range(20)), "end")
    print("ERR", f"rank={rank}", f"i={i}", *(f"w{j}" for j in range(20)), "end", file=sys.stderr)
