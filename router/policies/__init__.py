"""One file per routing mode, each a class behind `Policy`; `make_policy` picks one by name."""
