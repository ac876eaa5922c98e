"""Fitting: lambda and beta as parameters, learned from labelled conversations.

- :mod:`.model`: ``MapMatchedModel``, the ``nn.Module`` holding the weights (decode,
  log partition, marginals, negative log-likelihood);
- :mod:`.fitting`: packing labelled conversations, the CRF loss, ``fit_weights``;
- :mod:`.sampling`: synthetic labelled conversations sampled from the model.
"""

from . import fitting
from .fitting import *  # noqa: F401,F403  (the old fit module's public names)
from .fitting import NDCG_K  # noqa: F401  (public in the old module, not in its __all__)
from .model import MapMatchedModel

__all__ = ["MapMatchedModel", *fitting.__all__]
