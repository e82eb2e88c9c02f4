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

fam.doc('STATS',
        "STATS ['path'] [AT n POSITIONS]",
        "the container's facts: layers, operator mix, objects, continuation state in bytes",
        'STATS AT 4096 POSITIONS;', order=20)
fam.doc('SHOW LAYERS',
        'SHOW LAYERS [[RANGE] a-b]',
        'the per-layer policy and continuation geometry',
        'SHOW LAYERS RANGE 0-1;', order=40)
fam.doc('SHOW COMPONENTS',
        'SHOW COMPONENTS',
        "the graph's components and their roles",
        'SHOW COMPONENTS;', order=50)
fam.doc('SHOW REPRESENTATIONS',
        "SHOW REPRESENTATIONS ['filter']",
        'physical representations: segment files, tensor counts, bytes, hashes',
        "SHOW REPRESENTATIONS 'embedding';", order=60)
fam.doc('SHOW PROVENANCE',
        'SHOW PROVENANCE',
        'where the container came from',
        'SHOW PROVENANCE;', order=70)
fam.doc('SHOW OPERANDS',
        'SHOW OPERANDS [LAYER n]',
        'the tensors each op reads, with dtype, shape and bytes',
        'SHOW OPERANDS LAYER 0;', order=80)


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
