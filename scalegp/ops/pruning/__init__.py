"""Pruning, backend-neutral: the k-d order of points and their tiles (`_order`), tile boxes,
the rigorous bounds and each product's per-row rule (`_bounds`), the host tree over key tiles
and its visit lists (`_tree`), the host-planned KDE generic over a backend's passes
(`_planned`), and the rules on unordered points (`_rules`: the tolerance, keys
put in order, ``prune="auto"``, the entry points that run a backend's pruned core,
`scalegp.ops._interface.PrunedCore`). The backends' pruned cores and the products use what this
package exports; read `_rules`' docstring first.

Library-internal (no ``__all__``): users reach it through `scalegp.ops`.
"""

from scalegp.ops.pruning._bounds import (
    LOOSE,
    box_gaps,
    boxes,
    loosened,
    lse_added,
    lse_bounds,
    lse_candidates,
    lse_level,
    lse_log_tol,
    lse_near,
    lse_plan,
    lse_rest,
    lse_rest_visits,
    lse_setup,
    mv_box_visits,
    mv_include,
    mv_levels,
    mv_setup,
    one_box,
    tile_box,
    visit_list,
)
from scalegp.ops.pruning._order import (
    host_kd_order,
    identity_order,
    kd_order,
    ordered_tiles,
    tile_values,
    unordered,
)
from scalegp.ops.pruning._planned import (
    PlannedDensity,
    PlannedPasses,
    default_device,
    on_host,
    reach_gate,
)
from scalegp.ops.pruning._planned import planned_kernel_logsumexp as planned_logsumexp
from scalegp.ops.pruning._rules import (
    AUTO_GATE,
    AUTO_MAX_VISITED,
    AUTO_SAMPLE_TILES,
    PRUNE_BLOCK,
    OrderedKeys,
    auto_keys,
    check_prune,
    considered_by_auto,
    default_tolerance,
    kde_max_visited,
    kernel_logsumexp,
    ordered_keys,
    ordered_queries,
    pays_in_order,
    pruned_product,
    pruning_pays,
    reach_allows_pruning,
    spatial_order,
    worth_ordering,
)
from scalegp.ops.pruning._tree import (
    Plan,
    build_tree,
    joined,
    near_plan,
    padded_length,
    rest_plan,
)
