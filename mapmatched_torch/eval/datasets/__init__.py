"""Dataset loaders, one module per format; each produces an
:class:`~mapmatched_torch.eval.data.Dataset` (the in-memory form, in :mod:`..data`).

- :mod:`.normalized`: the normalized JSON Lines format (``read_passages``,
  ``load_normalized``) and the ``--data`` folder that holds it (``load_directory``);
- :mod:`.inscit`: INSCIT's original split files (``load_inscit``);
- :mod:`.topiocqa`: TopiOCQA's rows (``load_topiocqa``);
- :mod:`.trec_cast`: TREC CAsT topics, qrels and passages (``load_trec_cast``).
"""

from __future__ import annotations

from .inscit import load_inscit
from .normalized import load_directory, load_normalized, read_passages
from .topiocqa import load_topiocqa
from .trec_cast import load_trec_cast

__all__ = ["load_normalized", "load_directory", "load_inscit", "load_topiocqa", "load_trec_cast", "read_passages"]
