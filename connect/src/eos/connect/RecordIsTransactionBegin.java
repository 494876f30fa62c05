package eos.connect;

import java.util.Map;

import org.apache.kafka.common.config.AbstractConfig;
import org.apache.kafka.common.config.ConfigDef;
import org.apache.kafka.connect.connector.ConnectRecord;
import org.apache.kafka.connect.data.Field;
import org.apache.kafka.connect.data.Struct;
import org.apache.kafka.connect.transforms.predicates.Predicate;

/**
 * Matches a BEGIN record of Debezium's transaction topic, so that Kafka Connect's built-in
 * {@code Filter} drops it before it is written.
 *
 * <p>A mirror with whole transactions needs only the END records: an END names its transaction
 * and counts its events per table, and every change event names its transaction. A BEGIN says
 * nothing the END does not, yet with source transactions of a few changes it is about one record
 * in seven that the mirror reads. Debezium counts a transaction's events before any transform,
 * so dropping BEGINs leaves every END's counts true.
 *
 * <p>Only records of the configured {@code topic} can match; on it, a record matches when its
 * value is a {@link Struct} whose {@code status} is {@code BEGIN}. Anything else (an END, a
 * tombstone, a value of another shape) does not match and is kept, so the predicate can never
 * drop a change event or an END.
 */
public class RecordIsTransactionBegin<R extends ConnectRecord<R>> implements Predicate<R> {

    public static final String TOPIC_CONFIG = "topic";

    private static final ConfigDef CONFIG_DEF = new ConfigDef().define(
            TOPIC_CONFIG, ConfigDef.Type.STRING, ConfigDef.NO_DEFAULT_VALUE,
            new ConfigDef.NonEmptyString(), ConfigDef.Importance.HIGH,
            "Debezium's transaction topic (<topic.prefix>.transaction): "
                    + "only its BEGIN records match.");

    private String topic;

    @Override
    public ConfigDef config() {
        return CONFIG_DEF;
    }

    @Override
    public void configure(Map<String, ?> configs) {
        topic = new AbstractConfig(CONFIG_DEF, configs).getString(TOPIC_CONFIG);
    }

    @Override
    public boolean test(R record) {
        if (!topic.equals(record.topic()) || !(record.value() instanceof Struct value)) {
            return false;
        }
        Field status = value.schema().field("status");
        return status != null && "BEGIN".equals(value.get(status));
    }

    @Override
    public void close() {
    }

    @Override
    public String toString() {
        return "RecordIsTransactionBegin{topic=" + topic + "}";
    }
}
