"""What pgq needs around Spark, and the errors when it is missing."""

from __future__ import annotations

import pytest

from pgq.errors import SparkSetupError
from pgq.spark import environment
from pgq.spark.jdbc import jdbc_target


def test_a_missing_jdbc_jar_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("PGQ_JDBC_JAR", str(tmp_path / "nope.jar"))
    with pytest.raises(SparkSetupError, match="PGQ_JDBC_JAR"):
        environment.find_jdbc_jar()
    monkeypatch.delenv("PGQ_JDBC_JAR")
    monkeypatch.setattr(environment, "_DEBIAN_JARS", (str(tmp_path / "*.jar"),))
    with pytest.raises(SparkSetupError, match="apt-get install libpostgresql-jdbc-java"):
        environment.find_jdbc_jar()


def test_the_configured_jar_wins(monkeypatch, tmp_path):
    jar = tmp_path / "postgresql-42.7.jar"
    jar.write_bytes(b"PK")
    monkeypatch.setenv("PGQ_JDBC_JAR", str(jar))
    assert environment.find_jdbc_jar() == str(jar)


def test_missing_java_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SparkSetupError, match="Java 17"):
        environment.check_java()


def test_a_session_without_the_driver_is_refused(spark):
    environment.check_session(spark)  # the suite's session carries it

    class Conf:
        def get(self, key, default=None):
            return "" if key == "spark.jars" else default

    class Bare:
        conf = Conf()

    with pytest.raises(SparkSetupError, match="spark.jars"):
        environment.check_session(Bare())


def test_jdbc_url_keeps_host_and_carries_the_timeouts():
    target = jdbc_target("postgresql://app:s%40cret@db.example.com:6543/jobs?sslmode=require")
    assert target.url.startswith("jdbc:postgresql://db.example.com:6543/jobs?")
    assert "reWriteBatchedInserts=true" in target.url and "logServerErrorDetail=false" in target.url
    assert "statement_timeout%3D" in target.url and "idle_in_transaction_session_timeout" in target.url
    assert "sslmode=require" in target.url
    assert (target.user, target.password) == ("app", "s@cret")
    assert target.options()["driver"] == "org.postgresql.Driver"
