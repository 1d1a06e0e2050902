"""What Spark needs to reach pgq's databases: Java, PySpark, the JDBC driver.

:func:`spark_session` returns the active SparkSession or builds one that
ships the PostgreSQL JDBC driver to its executors (``spark.jars``: a local
jar is served by the driver, so nothing assumes a shared filesystem), logs
only errors and has no UI. Every check fails with
:class:`~pgq.errors.SparkSetupError` naming what to install.

Invariants: the driver jar is never fetched from Maven (``spark.jars.packages``
needs a network this product cannot assume); a session pgq did not build is
used as it is, after checking that it can load the driver.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..errors import SparkSetupError

__all__ = ["find_jdbc_jar", "check_java", "spark_session", "DRIVER_CLASS"]

DRIVER_CLASS = "org.postgresql.Driver"
_DEBIAN_JARS = ("/usr/share/java/postgresql.jar", "/usr/share/java/postgresql-*.jar")

_QUIET_LOG4J2 = """\
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = stderr
appender.stderr.type = Console
appender.stderr.name = stderr
appender.stderr.target = SYSTEM_ERR
appender.stderr.layout.type = PatternLayout
appender.stderr.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
logger.gateway.name = org.apache.spark.api.python.PythonGatewayServer
logger.gateway.level = error
logger.native.name = org.apache.hadoop.util.NativeCodeLoader
logger.native.level = error
"""


def find_jdbc_jar() -> str:
    """The PostgreSQL JDBC driver jar: ``$PGQ_JDBC_JAR``, else Debian's."""
    configured = os.environ.get("PGQ_JDBC_JAR")
    if configured:
        if not Path(configured).is_file():
            raise SparkSetupError(
                f"PGQ_JDBC_JAR={configured} is not a file: point it at the PostgreSQL JDBC "
                "driver jar (postgresql-42.x.jar)")
        return configured
    for pattern in _DEBIAN_JARS:
        for path in sorted(glob.glob(pattern)):
            if Path(path).is_file():
                return path
    raise SparkSetupError(
        "the PostgreSQL JDBC driver was not found: install it (Debian/Ubuntu: "
        "apt-get install libpostgresql-jdbc-java) or set PGQ_JDBC_JAR=/path/to/postgresql.jar")


def check_java() -> str:
    """The ``java`` executable Spark will start (``$JAVA_HOME`` first)."""
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").is_file():
        return str(Path(home) / "bin" / "java")
    found = shutil.which("java")
    if found is None:
        raise SparkSetupError(
            "Spark needs Java 17 or newer and none was found: install it (Debian/Ubuntu: "
            "apt-get install openjdk-17-jre-headless) or set JAVA_HOME")
    return found


def _import_pyspark() -> Any:
    try:
        import pyspark.sql
    except ImportError:
        raise SparkSetupError(
            "PySpark is not installed: pip install 'pgq-disque[spark]'") from None
    return pyspark.sql


def spark_session(master: str | None = None, app_name: str = "pgq",
                  config: dict[str, str] | None = None) -> Any:
    """The active SparkSession, or a new one set up for pgq.

    ``master`` defaults to ``$PGQ_SPARK_MASTER``, else ``local[*]``; pass
    ``spark://host:7077``, ``yarn`` or ``k8s://...`` for a real cluster.
    """
    sql = _import_pyspark()
    active = sql.SparkSession.getActiveSession()
    if active is not None:
        check_session(active)
        return active
    check_java()
    jar = find_jdbc_jar()
    # Local executors run this interpreter (the venv with pgq), not python3 from PATH.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    log_config = Path(tempfile.gettempdir()) / "pgq-spark-log4j2.properties"
    if not log_config.exists() or log_config.read_text() != _QUIET_LOG4J2:
        log_config.write_text(_QUIET_LOG4J2)
    builder = (sql.SparkSession.builder
               .master(master or os.environ.get("PGQ_SPARK_MASTER") or "local[*]")
               .appName(app_name)
               .config("spark.jars", jar)
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", "4")
               .config("spark.driver.extraJavaOptions",
                       f"-Dlog4j2.configurationFile=file:{log_config}"))
    for key, value in (config or {}).items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session


def check_session(spark: Any) -> None:
    """A session not built here must carry the JDBC driver (spark.jars)."""
    jars = spark.conf.get("spark.jars", "") or ""
    if "postgresql" not in jars:
        raise SparkSetupError(
            "this SparkSession has no PostgreSQL JDBC driver: build it with "
            f".config('spark.jars', '{_suggested_jar()}') or use pgq.spark.spark_session()")


def _suggested_jar() -> str:
    try:
        return find_jdbc_jar()
    except SparkSetupError:
        return "/path/to/postgresql.jar"
