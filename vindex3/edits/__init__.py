"""Knowledge edits as overlays bound to their base container.

A patch (`Patch`) is a list of edits (`Edit`), each one fitted by a named mode:

* ``compose``: one FFN feature per fact, written over the layer's weakest feature (gate and up
  rows along the fact's FFN input, the down column along the direction that raises the target);
* ``memit``: a closed-form rank-one term per fact added to FFN down projections at chosen layers,
  with a key covariance estimated from a named corpus (`memit_solve`);
* ``knn``: a retrieval overlay — no weight changes; a stored residual key at one layer overrides
  the next-token answer when a prompt's residual is close enough to it.

An overlay never modifies the container: `EditedModel` serves replaced tensors from memory
through its own tensor source, and `EditedModel.overrides()` gives them as full float32 arrays
keyed ``object/tensor`` (an `OperandRef.label`) for writers that bake them in. A patch records the
digest of the container it was made on and is refused on any other (`check_base`)."""

from .fit import FitSettings, fit_compose, fit_knn, fit_memit, memit_solve
from .overlay import KNN_LABEL, Edit, EditedModel, KnnKey, Patch, TensorWrite, check_base

__all__ = ["KNN_LABEL", "Edit", "EditedModel", "FitSettings", "KnnKey", "Patch", "TensorWrite", "check_base",
           "fit_compose", "fit_knn", "fit_memit", "memit_solve"]
