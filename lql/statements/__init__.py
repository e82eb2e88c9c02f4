"""The statement families, one module each (see `lql.registry`). Every module here is imported
once, in name order, by `lql.registry.discover`; a module registers its family when imported."""
