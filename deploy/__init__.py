"""Launchers for engines that place the cluster's processes on many hosts (Ray: `deploy.ray`) and the
Kubernetes manifests (`deploy/kubernetes`). Never imported by the gateway or the worker."""
