"""The `device-plugin` binding mode (CONTRACT.md §4, docs/binding.md): the node agent serves
the kubelet device-plugin API (v1beta1) for every `instaslice.io/mig-<profile>` it offers.
`_gen/` holds the gRPC stubs generated at build time by hack/gen-protos.sh (git-ignored)."""
