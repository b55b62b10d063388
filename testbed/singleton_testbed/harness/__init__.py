"""What the tests, the benchmarks and the demo share to drive the project's processes from
outside (development only, like the rest of the test bed): sidecars and operators as
processes (``sidecars``, ``operators``) and the API server through its REST API and kubectl
(``kubehelpers``). Tests import it, benchmarks import it; neither imports the other's modules
for it."""
