"""Model implementations, one file per architecture family; `registry` maps config names to them."""
