"""Run under the launcher: one process is told a different process or device count.

`python miscount.py processes` or `python miscount.py devices`: process 1 joins with a wrong
count; both processes must fail with a clear error, not hang.
"""

import os
import sys

from jaxembed import launch

if os.environ[launch.ENV_PROCESS_ID] == "1":
    if sys.argv[1] == "processes":
        os.environ[launch.ENV_NUM_PROCESSES] = "3"
    else:
        os.environ[launch.ENV_DEVICES] = "2"
launch.initialize()
print("joined", flush=True)
