"""Deployment bundles for a packaged model repository: Kubernetes manifests (kustomize layout), autoscaling on
the server's own metrics, and a Grafana dashboard, rendered in Python without a network or a helm binary."""
