"""The products over a `jax.sharding.Mesh`: query rows sharded, keys all-gathered or passed
around a ring (`_schemes`), gradients reduced; meshes from the estimators' settings (`_mesh`);
the public products (`_products`; docs/sharding.md).

Library-internal (no ``__all__``): users reach it through `scalegp.ops`.
"""

from scalegp.ops.sharding._mesh import (
    SCHEMES,
    as_mesh,
    check_scheme,
    data_mesh,
    mesh_axis,
    shard_rows,
)
from scalegp.ops.sharding._products import (
    sharded_expression_mv,
    sharded_kde_density,
    sharded_kernel_mv,
)
