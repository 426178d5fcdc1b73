"""pytest set-up shared by the unit tests and nbval: quiet, fixed threads, the model cache beside the checkout.

pytest puts this folder (the rootdir) first on ``sys.path``, so a checkout's own modules win over an
installed copy."""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("IGLENS_CACHE", str(ROOT / ".cache" / "models"))

import torch  # noqa: E402

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
