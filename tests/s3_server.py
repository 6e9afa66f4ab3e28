"""A real S3-compatible server for the tests: moto's standalone server on loopback, in a thread.

    with s3_server() as server:     # AWS_ENDPOINT_URL and dummy credentials set meanwhile
        server.bucket("ckpt")       # s3://ckpt/... is reachable from this process and its children
        server.copies               # every CopyObject / UploadPartCopy the server was asked for

The endpoint reaches longrun the way it reaches a user's job: through the standard
`AWS_ENDPOINT_URL` environment variable, which botocore (under s3fs) reads, so
`checkpoint.dir: s3://bucket/prefix` needs nothing else; processes started meanwhile (a
checkpointing subprocess, a Ray cluster's workers) inherit it. Copies are counted where they
happen, on the server: a request with an `x-amz-copy-source` header is S3's copy.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
       "AWS_DEFAULT_REGION": "us-east-1", "AWS_SESSION_TOKEN": "testing"}


class S3Server:
    def __init__(self) -> None:
        from moto.moto_server.threaded_moto_server import ThreadedMotoServer
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        counted = self

        class Quiet(MotoRequestHandler):
            def log_request(self, *args, **kwargs) -> None:  # one line per request otherwise
                pass

        class Server(ThreadedMotoServer):
            def _server_entry(self) -> None:
                app = DomainDispatcherApplication(create_backend_app)

                def counting(environ, start_response):
                    if environ.get("HTTP_X_AMZ_COPY_SOURCE"):
                        counted.copies.append(f"{environ['REQUEST_METHOD']} {environ.get('PATH_INFO')}")
                    return app(environ, start_response)
                self._server = make_server(self._ip_address, self._port, counting, True,
                                           request_handler=Quiet)
                self._server_ready_event.set()
                self._server.serve_forever()

        self.copies: list[str] = []
        self._server = Server(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"

    def bucket(self, name: str) -> str:
        """Create bucket `name`; returns its URL."""
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint).create_bucket(Bucket=name)
        return f"s3://{name}"

    def stop(self) -> None:
        self._server.stop()


@contextlib.contextmanager
def s3_server() -> Iterator[S3Server]:
    saved = {k: os.environ.get(k) for k in (*ENV, "AWS_ENDPOINT_URL")}
    os.environ.update(ENV)
    server = S3Server()
    os.environ["AWS_ENDPOINT_URL"] = server.endpoint
    try:
        yield server
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        import fsspec

        # s3fs instances are cached by their arguments, not by the environment they read:
        # one made for this server must not serve a later one.
        fsspec.get_filesystem_class("s3").clear_instance_cache()
