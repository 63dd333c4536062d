"""The gRPC wire protocol (`jaxpipe.proto`, service `jaxpipe.v1.Generation`) and the code
protoc generates from it (`scripts/gen_proto.py`): the server (`jaxpipe.serve`) answers it and
batch jobs sent to a server (`jaxpipe.batch.runners.RemoteRunner`) speak it, so it sits below
both.

    jaxpipe.proto        the API: Generate, GenerateBatch, GetServerInfo
    jaxpipe_pb2.py       its messages (generated; jaxpipe_pb2.pyi their types)
    jaxpipe_pb2_grpc.py  its service's stub and servicer (generated)
"""
