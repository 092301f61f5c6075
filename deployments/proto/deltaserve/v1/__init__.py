"""``deltaserve.v1``: inference.proto and its generated stubs (inference_pb2, inference_pb2_grpc)."""
