"""Facts that read no tensor data: STATS (of the bound container or another), SHOW LAYERS,
SHOW COMPONENTS, SHOW REPRESENTATIONS, SHOW PROVENANCE, SHOW OPERANDS."""

from __future__ import annotations

from .. import ast
from ..registry import family
from ..syntax import Children

fam = family("facts", module=__name__, statements=(
    "stats_stmt", "stats_path", "show_layers", "show_layers_bare", "show_components", "show_representations",
    "show_provenance", "show_operands"), grammar=r"""
stats_stmt: STATS [AT INT POSITIONS]
stats_path: STATS STRING [AT INT POSITIONS]
show_layers: SHOW LAYERS [RANGE layer_range]
show_layers_bare: SHOW LAYERS layer_range       // the reference's SHOW LAYERS a-b
show_components: SHOW COMPONENTS
show_representations: SHOW REPRESENTATIONS [STRING]
show_provenance: SHOW PROVENANCE
show_operands: SHOW OPERANDS [LAYER INT]
""")


@fam.rule
def stats_stmt(c: Children) -> ast.Stats:
    return ast.Stats(positions=c.int("AT"))


@fam.rule
def stats_path(c: Children) -> ast.Stats:
    return ast.Stats(path=c.string("STATS"), positions=c.int("AT"))


@fam.rule
def show_layers(c: Children) -> ast.ShowLayers:
    start, end = c.get("RANGE") or (None, None)
    return ast.ShowLayers(start=start, end=end)


@fam.rule
def show_layers_bare(c: Children) -> ast.ShowLayers:
    start, end = c.get("LAYERS")
    return ast.ShowLayers(start=start, end=end)


@fam.rule
def show_components(c: Children) -> ast.ShowComponents:
    return ast.ShowComponents()


@fam.rule
def show_representations(c: Children) -> ast.ShowRepresentations:
    return ast.ShowRepresentations(filter=c.string("REPRESENTATIONS"))


@fam.rule
def show_provenance(c: Children) -> ast.ShowProvenance:
    return ast.ShowProvenance()


@fam.rule
def show_operands(c: Children) -> ast.ShowOperands:
    return ast.ShowOperands(layer=c.int("LAYER"))
