"""The `device-plugin` binding mode (docs/contract.md §4, docs/binding.md): the node agent serves
the kubelet device-plugin API (v1beta1) for every `instaslice.io/mig-<profile>` it offers.
`_gen/` holds the gRPC stubs hack/gen-protos.sh generates from the protos vendored in
third_party/k8s.io/kubelet/; they are committed, so no build step needs Go or protoc."""
