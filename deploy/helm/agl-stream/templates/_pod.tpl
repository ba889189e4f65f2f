{{/* The pod spec every role shares: (dict "root" $ "role" "runner" "values" .Values.runner
     "args" (list ...) "env" "..." "ports" (list ...) "gpus" 0 "extraMounts" "..." "extraVolumes" "..."). */}}
{{- define "agl.podSpec" -}}
{{- $root := .root -}}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
terminationGracePeriodSeconds: 60
containers:
  - name: {{ .role }}
    image: {{ include "agl.image" $root }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    args:
      {{- toYaml .args | nindent 6 }}
    env:
      {{- .env | nindent 6 }}
    {{- if or .metrics .ports }}
    ports:
      {{- if .metrics }}
      - {name: metrics, containerPort: {{ $root.Values.metrics.port }}}
      {{- end }}
      {{- range .ports }}
      - {name: {{ .name }}, containerPort: {{ .port }}}
      {{- end }}
    {{- end }}
    {{- with .probes }}
    {{- . | nindent 4 }}
    {{- end }}
    securityContext:
      {{- toYaml $root.Values.securityContext | nindent 6 }}
    resources:
      {{- $resources := deepCopy (.values.resources | default dict) }}
      {{- if gt (int (.gpus | default 0)) 0 }}
      {{- $limits := merge (dict "nvidia.com/gpu" (int .gpus)) ($resources.limits | default dict) }}
      {{- $_ := set $resources "limits" $limits }}
      {{- end }}
      {{- toYaml $resources | nindent 6 }}
    volumeMounts:
      {{- include "agl.volumeMounts" $root | nindent 6 }}
      {{- with .extraMounts }}
      {{- . | nindent 6 }}
      {{- end }}
volumes:
  {{- include "agl.volumes" $root | nindent 2 }}
  {{- with .extraVolumes }}
  {{- . | nindent 2 }}
  {{- end }}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "agl.checkpointVolume" -}}
- name: checkpoints
  persistentVolumeClaim:
    claimName: {{ include "agl.checkpointClaim" . }}
{{- end -}}
