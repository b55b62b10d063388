"""singleton sidecar: leader election with fencing tokens for one replica group."""
