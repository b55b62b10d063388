"""The singleton operator: reconciles SingletonService objects into workloads with the sidecar."""
