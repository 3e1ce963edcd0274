"""float64 NumPy goldens with the device's roundings. Importing this registers the ``"reference"`` backend."""

from . import fused_linear_cross_entropy_loss_grad  # noqa: F401
from . import fused_linear_online_max_sum  # noqa: F401
from . import fused_cross_entropy_loss_with_max_sum  # noqa: F401
from . import cross_entropy_loss_grad  # noqa: F401
from . import scaled_masked_softmax_backward  # noqa: F401
from . import smooth_l1_loss_backward  # noqa: F401
from . import embedding_dense_backward  # noqa: F401
