"""Operators as plug-ins: one module per operator, registered by name (see base.py and
docs/operators.md#adding-an-operator)."""

from .base import (
    ARRAY,
    FFN,
    MATRIX,
    MIXER,
    FeatureFfn,
    FeatureView,
    Kernel,
    Operator,
    OpRecord,
    Params,
    ReadProfile,
    Role,
    all_operators,
    distinct_bytes,
    get,
    no_features_reason,
    parse_params,
    register,
    registered,
    selected,
    unregister,
)

__all__ = [
    "ARRAY", "FFN", "MATRIX", "MIXER", "FeatureFfn", "FeatureView", "Kernel", "OpRecord", "Operator", "Params",
    "ReadProfile", "Role", "all_operators", "distinct_bytes", "get", "no_features_reason", "parse_params", "register", "registered", "selected",
    "unregister",
]
