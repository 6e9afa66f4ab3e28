"""Local servers longrun embeds when no external one is configured: Redis and a Ray head."""

from longrun.services.process import ManagedProcess, ServiceError
from longrun.services.ray_head import EmbeddedRay
from longrun.services.redis_server import EmbeddedRedis, TlsFiles, find_redis_server

__all__ = ["EmbeddedRay", "EmbeddedRedis", "ManagedProcess", "ServiceError", "TlsFiles", "find_redis_server"]
