"""Plans, captured graphs, the artifact and its launcher: arrive with the GPU targets."""
