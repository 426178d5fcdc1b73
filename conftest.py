"""pytest set-up shared by the unit tests and nbval: repository on sys.path, quiet, fixed threads."""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("IGLENS_CACHE", str(ROOT / ".cache" / "models"))

import torch  # noqa: E402

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
