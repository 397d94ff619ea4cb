"""A stand-in measurement worker for tests/bench/test_process_worker.py: prints its argument after a noise line;
"fail" exits 4 with a message, "sleep" sleeps."""
import sys
import time

arg = sys.argv[1]
print("warming up")
if arg == "fail":
    print("the measurement broke", file=sys.stderr)
    sys.exit(4)
if arg == "sleep":
    time.sleep(30)
print(arg)
