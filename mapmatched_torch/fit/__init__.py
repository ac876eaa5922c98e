"""Fitting: lambda and beta as parameters, learned from labelled conversations.

- :mod:`.model`: ``MapMatchedModel``, the ``nn.Module`` holding the weights (decode,
  log partition, marginals, negative log-likelihood);
- :mod:`.packing`: labelled conversations validated and packed into tensors;
- :mod:`.loss`: the negative log-likelihood of the labels (the CRF loss);
- :mod:`.metric`: the validation metric, nDCG@3 of the decoded path;
- :mod:`.fitting`: ``fit_weights``, the optimisation loop and early stopping;
- :mod:`.sampling`: synthetic labelled conversations sampled from the model.
"""

from . import fitting, loss, metric, packing
from .fitting import *  # noqa: F401,F403
from .loss import *  # noqa: F401,F403
from .metric import *  # noqa: F401,F403
from .metric import NDCG_K  # noqa: F401  (public in the old fit module, not in its __all__)
from .model import MapMatchedModel
from .packing import *  # noqa: F401,F403

__all__ = ["MapMatchedModel", *fitting.__all__, *loss.__all__, *packing.__all__, *metric.__all__]
