"""Helpers of scripts/check_docker.py and test/test_docker.py: the images' Dockerfiles read as
data with their build context, the repository's own pins they must agree with, and hadolint."""
