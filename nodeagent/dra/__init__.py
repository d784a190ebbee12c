"""DRA mode on the node (docs/dra.md): the agent's pool of ResourceSlices (`pool`, `publish`)
and the kubelet's DRA plugin API. Gate mode runs none of it."""
