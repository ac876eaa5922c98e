"""Retrieval: sessions over a corpus graph, and the tensor decoder behind them.

- :mod:`.session`: ``MapMatchedRetriever`` and ``MapMatchedSession`` (SPEC section 6);
- :mod:`.turns`: the per-turn work sessions and the server share (options, a turn's
  candidates in, its trace, context and result out);
- :mod:`.torch_decoder`: ``TorchDecoder``, the ``Decoder`` protocol on tensors;
- :mod:`.trellis`: packing ragged trellises into padded tensors and back;
- :mod:`.streaming`: one conversation decoded incrementally, and the host-side glue
  of the slot decoder.

The session's names are imported here (plain Python); the tensor modules load on
first access, so ``import mapmatched_torch`` stays cheap.
"""

from __future__ import annotations

from .._lazy import lazy_attributes
from . import session
from .session import *  # noqa: F401,F403  (the session's public names; the old module's)

_LAZY = {"TorchDecoder": ".torch_decoder", "PackedTrellis": ".trellis", "pack_trellises": ".trellis", "DecodingStream": ".streaming"}

__all__ = [*session.__all__, *_LAZY]

__getattr__ = lazy_attributes(__name__, _LAZY, globals())
