package dev.aglstream.registry;

import io.apicurio.common.apps.config.DynamicConfigPropertyList;
import java.util.List;
import javax.enterprise.inject.Produces;
import javax.inject.Singleton;

/**
 * The bean that Apicurio's config-index extension would build at Quarkus build time.
 *
 * <p>That extension's deployment artifact is not published on Maven Central, so it is left out
 * and this producer stands in: an empty list means no property can be changed at run time
 * through the admin API, which agl-stream never does.
 */
public class DynamicConfigPropertyListProducer {

  @Produces
  @Singleton
  DynamicConfigPropertyList dynamicConfigPropertyList() {
    return new DynamicConfigPropertyList(List.of());
  }
}
