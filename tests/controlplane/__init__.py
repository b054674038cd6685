# A package so that its modules (cluster, conftest, tests) don't clash by basename with others.
