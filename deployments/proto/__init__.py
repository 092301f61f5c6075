"""Protocol buffer definitions of deltaserve's gRPC API and their generated stubs (scripts/gen_proto.sh)."""
