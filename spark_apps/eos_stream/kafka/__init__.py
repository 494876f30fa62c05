"""Reading Kafka: the partitions' names, each batch's offset ranges, topic metadata and the
client's security settings. Imports nothing else of the app."""
