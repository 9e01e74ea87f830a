"""Every test process (and the subprocesses tests start) converts GGUF checkpoints into one
throw-away cache, not the user's ~/.cache/jaxrunner."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

if "JAXRUNNER_CACHE" not in os.environ:
    os.environ["JAXRUNNER_CACHE"] = tempfile.mkdtemp(prefix="jaxrunner-test-cache-")
    atexit.register(shutil.rmtree, os.environ["JAXRUNNER_CACHE"], True)
