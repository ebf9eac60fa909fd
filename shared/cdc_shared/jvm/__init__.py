"""The JVM side: artifacts, the SparkSession, and every call beyond PySpark's public API."""
