"""ebbtide.testing: what the tests and the bench share, shipped with the package (as DeepGEMM ships its testing/)."""
